"""The same short text in several languages and scripts (the `multilingual` workload).

A tokenizer trained mostly on English spends more tokens per character on other scripts; the
benchmark reports tokens per character per language, the input-length multiplier a user serving
those languages pays in prefill time and KV memory. Translations written for kvflow (same content,
plain register); the text is a library notice, chosen for ordinary vocabulary in every language.
"""

from __future__ import annotations

PARALLEL_TEXTS: dict[str, str] = {
    "en": (
        "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow "
        "up to five books for three weeks. Please return books on time so that other readers can enjoy "
        "them too. If you have any questions, ask at the front desk."
    ),
    "fr": (
        "La bibliothèque ouvre à neuf heures du matin et ferme à six heures du soir. Les visiteurs "
        "peuvent emprunter jusqu'à cinq livres pendant trois semaines. Merci de rendre les livres à "
        "temps afin que d'autres lecteurs puissent aussi en profiter. Pour toute question, adressez-vous "
        "à l'accueil."
    ),
    "de": (
        "Die Bibliothek öffnet um neun Uhr morgens und schließt um sechs Uhr abends. Besucher können bis "
        "zu fünf Bücher für drei Wochen ausleihen. Bitte geben Sie die Bücher rechtzeitig zurück, damit "
        "auch andere Leser sie genießen können. Bei Fragen wenden Sie sich bitte an die Information."
    ),
    "es": (
        "La biblioteca abre a las nueve de la mañana y cierra a las seis de la tarde. Los visitantes "
        "pueden tomar prestados hasta cinco libros durante tres semanas. Por favor, devuelva los libros "
        "a tiempo para que otros lectores también puedan disfrutarlos. Si tiene alguna pregunta, "
        "consulte en el mostrador de recepción."
    ),
    "ru": (
        "Библиотека открывается в девять часов утра и закрывается в шесть часов вечера. Посетители могут "
        "взять до пяти книг на три недели. Пожалуйста, возвращайте книги вовремя, чтобы другие читатели "
        "тоже могли ими пользоваться. Если у вас есть вопросы, обратитесь к стойке информации."
    ),
    "zh": (
        "图书馆早上九点开门，晚上六点关门。读者最多可以借五本书，借期三周。请按时还书，以便其他读者也能"
        "阅读。如有任何问题，请到服务台咨询。"
    ),
    "ja": (
        "図書館は午前九時に開館し、午後六時に閉館します。利用者は本を五冊まで三週間借りることができます。"
        "ほかの利用者も読めるように、期限までに返却してください。ご質問は受付でお尋ねください。"
    ),
    "ko": (
        "도서관은 오전 아홉 시에 문을 열고 오후 여섯 시에 문을 닫습니다. 방문객은 책을 다섯 권까지 삼 주 "
        "동안 빌릴 수 있습니다. 다른 독자들도 읽을 수 있도록 책을 제때 반납해 주세요. 궁금한 점이 "
        "있으면 안내 데스크에 문의하세요."
    ),
    "ar": (
        "تفتح المكتبة في الساعة التاسعة صباحًا وتغلق في الساعة السادسة مساءً. يمكن للزوار استعارة ما يصل "
        "إلى خمسة كتب لمدة ثلاثة أسابيع. يرجى إعادة الكتب في موعدها حتى يتمكن القراء الآخرون من الاستمتاع "
        "بها أيضًا. إذا كانت لديك أي أسئلة، فاسأل في مكتب الاستقبال."
    ),
    "hi": (
        "पुस्तकालय सुबह नौ बजे खुलता है और शाम छह बजे बंद होता है। आगंतुक तीन सप्ताह के लिए पाँच किताबें "
        "तक उधार ले सकते हैं। कृपया किताबें समय पर लौटाएँ ताकि दूसरे पाठक भी उनका आनंद ले सकें। यदि आपके "
        "कोई प्रश्न हों, तो स्वागत कक्ष पर पूछें।"
    ),
}
